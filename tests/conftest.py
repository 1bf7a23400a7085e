import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# every distributed test (spawned or launched) transfers under NCCL's ordering rule (hf_asyncpp/pipeline/nccl_order.py):
# a post order that would hang on GPUs fails here
os.environ.setdefault("HF_ASYNCPP_P2P", "nccl-order")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402
from support import TASK_FILES  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def folders(tmp_path_factory):
    """Three exported models: one trained on the fixtures' correct answers, one half-trained (step 60: its acc_norm
    picks differ from the old with-delimiter definition on arc_easy, arc_challenge and hellaswag), one untrained."""
    from hf_asyncpp.eval.tasks import load_items
    from hf_asyncpp.model.export import export_hf_model
    from hf_asyncpp.data.tokenizer import train_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("models")
    texts = []
    for t, f in TASK_FILES.items():
        for ctx, choices, label in load_items(t, f):
            texts.append(ctx + choices[label])
    corpus = root / "answers.txt"
    corpus.write_text("\n".join(texts * 3) + "\n")
    tok = train_tokenizer([str(corpus)], 300)
    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=128,
                               eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    untrained = AutoModelForCausalLM.from_config(cfg)
    trained = AutoModelForCausalLM.from_config(cfg)
    trained.load_state_dict(untrained.state_dict())
    opt = torch.optim.AdamW(trained.parameters(), lr=3e-3)
    enc = [tok(x, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for x in texts]
    half = None
    for step in range(300):
        if step == 60:
            half = {k: v.clone() for k, v in trained.state_dict().items()}
        batch = [enc[(step * 8 + j) % len(enc)] for j in range(8)]
        w = max(map(len, batch))
        ids = torch.tensor([b + [tok.pad_token_id] * (w - len(b)) for b in batch])
        labels = torch.tensor([b + [-100] * (w - len(b)) for b in batch])
        trained(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    out = {}
    for name, sd in (("trained", trained.state_dict()), ("half", half), ("untrained", untrained.state_dict())):
        out[name] = str(export_hf_model(sd, cfg, root / name, tokenizer=tok))
    return out



@pytest.fixture(autouse=True)
def _recipe_warnings_said_afresh():
    """A recipe warning is said once per process (the process that starts the ranks loads the recipe twice); each
    test is a run of its own, so each starts with nothing said."""
    from hf_asyncpp.config import recipe as config

    config._SAID.clear()
    yield
