# Sourced by the ablation examples: HARDWARE_FLAGS for tools/ablate.py. HARDWARE=<name or
# calibrated JSON profile> sets the profile of the predicted step time; without it, this
# machine's, once measured with `python -m megapp.plan --calibrate` (written to
# runs/calibration/hardware.json), if there is one.
CALIBRATED=runs/calibration/hardware.json
if [[ -z "${HARDWARE:-}" && -f "$CALIBRATED" ]]; then
    HARDWARE=$CALIBRATED
fi
HARDWARE_FLAGS=()
if [[ -n "${HARDWARE:-}" ]]; then
    HARDWARE_FLAGS=(--hardware "$HARDWARE")
fi
