"""Package data: model-card templates (installed as ``hf_asyncpp.model_cards``, see setup.py's package_dir)."""
