from megapp.testing import shutdown_worlds


def pytest_sessionfinish(session, exitstatus):
    # Stop the shared worlds before pytest's own teardown, so no worker outlives the run.
    shutdown_worlds()
