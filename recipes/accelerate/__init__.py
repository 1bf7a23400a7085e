"""Package data: accelerate launch configs (installed as ``hf_asyncpp.accelerate_configs``, see setup.py)."""
