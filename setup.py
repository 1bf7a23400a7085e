from setuptools import find_packages, setup

setup(
    name="hf_asyncpp",
    version="0.1.0",
    description="Asynchronous pipeline-parallel (PipeDream-2BW) LLM pretraining for the Hugging Face ecosystem",
    python_requires=">=3.10",
    # the model-card template and the accelerate configs live at the top of the checkout (model_cards/,
    # recipes/accelerate/) and ship inside the package, so a wheel install can export and print launch commands
    packages=find_packages(include=["hf_asyncpp", "hf_asyncpp.*"]) + ["hf_asyncpp.model_cards", "hf_asyncpp.accelerate_configs"],
    package_dir={"hf_asyncpp.model_cards": "model_cards", "hf_asyncpp.accelerate_configs": "recipes/accelerate"},
    package_data={"hf_asyncpp.model_cards": ["*.md"],
                  "hf_asyncpp.accelerate_configs": ["*.yaml"]},
    entry_points={"console_scripts": ["hf-asyncpp=hf_asyncpp.cli:run"]},
    # Each lower bound is the version the test suite passed with (constraints.txt): older ones are untested, and the
    # code reaches into torch and transformers where their public APIs stop, through names that move between minor
    # releases: torch.distributed.pipelining._backward.stage_backward_input/weight,
    # torch.nn.utils.stateless._reparametrize_module, distributed_c10d._set_pg_timeout/_get_default_store,
    # torch._dynamo.config.recompile_limit, torch._foreach_*; transformers' core_model_loading.revert_weight_conversion,
    # integrations.sdpa_attention.sdpa_attention_forward, tokenization_utils_base.VERY_LARGE_INTEGER and the
    # _is_hf_initialized / _init_weights / _can_record_outputs / all_tied_weights_keys protocol. A version below a
    # bound may well work; run `bash scripts/test.sh` on it before lowering one. tests/test_layout.py checks that
    # every third-party module the package imports is declared here and that constraints.txt satisfies each range.
    install_requires=[
        "torch>=2.13",  # install the CPU or CUDA build you want first (the package index decides, not this range)
        "transformers>=5.23,<6",
        "accelerate>=1.15",
        "datasets>=5.2",
        "tokenizers>=0.23.3",
        "safetensors>=0.8",
        "huggingface_hub>=2.4",
        "numpy>=2.4.6",  # the shuffle buffer's generator (data/shuffle.py)
        "pyarrow>=26",  # parquet corpora (data/files.py)
        "pyyaml>=6.0.4",
        "tqdm>=4.70.1",
        "matplotlib>=3.11.2",
        # the default tracker of every shipped recipe (training.report_to: [tensorboard], logs/<project>/ in each
        # run's folder): as an extra, the first run of any shipped recipe would stop on a missing package
        "tensorboard>=2.21",
        "fsspec>=2026.9.0",  # data files opened as datasets opens them, compressed or not (data/files.py)
        "zstandard>=0.25",  # .zst corpora (DCLM, Dolma, RedPajama): fsspec decompresses them for datasets and the screening
        "psutil>=7.2.2",  # the launcher passes a second Ctrl-C on to its workers (accelerate needs it too)
    ],
    extras_require={
        # lm-evaluation-harness, the zero-shot scorer (eval.tasks, hf-asyncpp evaluate --tasks; during training too,
        # through the pipeline's stages). An extra, not a requirement: training and perplexity do not need it (nor
        # its scikit-learn, sacrebleu, rouge-score), and a recipe or command that asks for a task without it stops
        # at once with one line naming `pip install hf_asyncpp[eval]`
        "eval": ["lm-eval>=0.4.13,<0.5"],
        "test": ["pytest>=8", "pytest-xdist>=3.5", "lm-eval>=0.4.13,<0.5"],
        "wandb": ["wandb>=0.17"],
        "mlflow": ["mlflow>=2.10"],
    },
)
