from setuptools import find_packages, setup

setup(
    name="hf_asyncpp",
    version="0.1.0",
    description="Asynchronous pipeline-parallel (PipeDream-2BW) LLM pretraining for the Hugging Face ecosystem",
    python_requires=">=3.10",
    packages=find_packages(include=["hf_asyncpp", "hf_asyncpp.*"]),
    package_data={"hf_asyncpp": ["metrics/*/*.py"]},
    install_requires=[
        "torch>=2.9,<2.15",  # 2.13.0 CPU wheel on our machines; an open range would pull a CUDA build
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
    ],
    extras_require={
        # lm-evaluation-harness as a scorer (eval.backend: lm_eval); the parity test runs it too
        "eval": ["lm-eval>=0.4.13,<0.5"],
        "test": ["pytest>=8", "lm-eval>=0.4.13,<0.5"],
    },
)
