"""What the benchmarks in ``tools/benchmarks/`` and the GPU check share, as library code.

* :mod:`~megapp.benchmarks.common`: provenance (command, machine, sources), interleaved
  timing, tables and JSON, and :class:`~megapp.benchmarks.common.Ranks` (a gloo world);
* :mod:`~megapp.benchmarks.gpt_stack`: the GPT the GPT benchmark trains and the one place it
  builds the training stack; :mod:`~megapp.benchmarks.gpt_mfu` its TFLOP/s and MFU on one
  device;
* :mod:`~megapp.benchmarks.gpu_check` (``tools/gpu_check.sh``): build, test and measure the
  CUDA paths on a GPU machine, stage by stage (:mod:`~megapp.benchmarks.gpu_stages`), into
  one report (:mod:`~megapp.benchmarks.gpu_report`).

Benchmarks measure; nothing here judges a timing.
"""
