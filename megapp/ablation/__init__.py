"""Parallelism ablations: one model trained under many layouts, each measured, predicted and
checked to train the single-process model.

* :mod:`~megapp.ablation.points`: a sweep's spec and the layouts it expands to, each checked
  as ``pretrain_gpt.py`` checks its flags; the update rule of each schedule;
* :mod:`~megapp.ablation.launch`: a point's torchrun command and a run with a time limit
  (over :mod:`megapp.training.launch`);
* :mod:`~megapp.ablation.records`: what a point measured, read from its metrics file;
* :mod:`~megapp.ablation.predict`: the planner's figures for the same layout;
* :mod:`~megapp.ablation.parity`: the alarm when a layout trains another model;
* :mod:`~megapp.ablation.twins`: the dense twin a model with experts is measured against;
* :mod:`~megapp.ablation.sweep`: running (and resuming) a sweep; :mod:`~megapp.ablation.slurm`
  the same as a SLURM array;
* :mod:`~megapp.ablation.report` and :mod:`~megapp.ablation.plots`: the markdown report;
* :mod:`~megapp.ablation.published`: predictions held to published Megatron runs.

``python -m megapp.ablation`` (or ``tools/ablate.py``) runs a sweep
(:mod:`~megapp.ablation.command`); ``tools/ablation_report.py`` writes its report.
"""
