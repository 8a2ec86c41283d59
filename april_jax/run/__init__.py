"""One RL run: its loop (trainer.py), its parts built from the config (parts.py), resume
(resume.py), a LoRA run's kept base (lora_base.py) and its end-of-run report (report.py)."""
