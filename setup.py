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
    package_data={"hf_asyncpp.eval": ["metrics/*/*.py"], "hf_asyncpp.model_cards": ["*.md"],
                  "hf_asyncpp.accelerate_configs": ["*.yaml"]},
    entry_points={"console_scripts": ["hf-asyncpp=hf_asyncpp.cli:run"]},
    install_requires=[
        "torch>=2.9",  # install the CPU or CUDA build you want first (the package index decides, not this range)
        "transformers>=5,<6",
        "accelerate>=1.10",
        "datasets>=4",
        "evaluate>=0.4.5",
        "tokenizers>=0.21",
        "safetensors>=0.5",
        "huggingface_hub>=1.0",
        "pyyaml>=6",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "tensorboard>=2.15",
        "psutil>=5.9",  # the launcher passes a second Ctrl-C on to its workers (accelerate needs it too)
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
