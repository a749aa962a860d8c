"""Training runs: a model loaded by name or path, a recipe applied, its parts fitted by the
trainers of ``leapfx.train`` (resumable from checkpoints), a held-out report, the parts
written; what the ``leapfx train-*`` commands run. A floor above ``rewrite`` (a run applies a
recipe), while ``train`` sits below it (``sm.fit`` reaches its trainers, which ``rewrite.apply``
hands the model): ``drafters.py`` (EAGLE, Kangaroo), ``m2r2.py`` (M2R2's accelerator).
"""
