"""EAGLE-3 head training in JAX.

    data.py      prompts -> target responses -> target features, stored as npz shards + manifest
    features.py  the jitted target prefill that records the aux hidden states and greedy next tokens
    dataset.py   draft vocabulary (d2t / t2d) and packed training rows, deterministic batches
    forward.py   the head as pure functions of its flat parameters; the unrolled training forward
    loss.py      training-time-test loss and per-step accuracy
    trainer.py   optax AdamW loop, orbax checkpoints + resume, logs, export to a draft directory
    plot.py      loss / accuracy curves

CLI: scripts/train_eagle.py; the default model's head: scripts/train_default_head.sh.
"""
