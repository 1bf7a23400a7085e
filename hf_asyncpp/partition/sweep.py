"""Every causal-LM type of the installed transformers, built tiny and split into stages: which split exactly.

Used by tests/test_partition_sweep.py (a share of the types) and scripts/partition_sweep.py (all of them, writing
docs/supported-models.md). A type is skipped only when it is an encoder-decoder, multimodal or not causal; every
other type gets a verdict: ``exact`` (loss and every gradient equal the unpartitioned model's at each stage
count), ``differs`` (the stages run but compute something else: a bug), or ``refused`` (PartitionError, whose
message names the module or operation).
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from .plan import PartitionError
from .stage import partition_model, tied_parameters

SEQ = 24
# (config keys, tiny value): each key the type's config has is set; the rest keeps the type's defaults
TINY = [(("hidden_size", "n_embd", "d_model", "n_embed"), 64), (("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 4),
        (("num_attention_heads", "n_head", "num_heads", "n_heads"), 4), (("num_key_value_heads", "multi_query_group_num"), 2),
        (("intermediate_size", "ffn_dim", "n_inner", "d_ff", "ffn_hidden_size"), 128), (("vocab_size",), 512),
        (("head_dim",), 16), (("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 4),
        (("num_experts_per_tok", "moe_topk", "moe_top_k", "moe_k"), 2), (("moe_intermediate_size", "expert_intermediate_size"), 32),
        (("max_position_embeddings", "n_positions", "n_ctx"), 128), (("kv_lora_rank", "q_lora_rank"), 16),
        (("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"), 8), (("rotary_dim",), 8), (("sliding_window",), 8),
        (("attention_window",), 8), (("chunk_size",), 8), (("n_group", "topk_group"), 1),
        (("vocab_size_per_layer_input",), 512), (("output_router_logits",), True), (("router_aux_loss_coef",), 0.05)]
# per-type corrections where the generic sizes break a config's own validation or shape rules
OVERRIDES: dict[str, dict] = {
    "bailing_hybrid": dict(num_expert_group=1, topk_group=1, num_experts_per_token=2, linear_head_dim=16,
                           linear_num_heads=4, layer_group_size=2),
    "bamba": dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8, attn_layer_indices=[1, 3]),
    # byte latent transformer: a local encoder, a global transformer (the decoder layers) and a local decoder
    "blt": dict(vocab_size=260, local_attention_window_len=8, encoder_hash_byte_group_size=[3, 4],
                encoder_hash_byte_group_vocab=512, patching_mode=None, patch_size=4,
                patcher_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
                encoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2, num_hidden_layers=1,
                                    intermediate_size=64),
                decoder_config=dict(hidden_size=32, hidden_size_global=64, num_attention_heads=2, num_hidden_layers=1,
                                    intermediate_size=64),
                global_config=dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=4, intermediate_size=128)),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"] * 2,
                                rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                 for t in ("sliding_attention", "full_attention")}),
    "dbrx": dict(attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}, ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2}),
    "dots3_note_text": dict(num_key_value_heads=4, head_dim=16, index_head_dim=16, index_topk=8,
                            shared_experts_intermediate_size=32, per_layer_config={}),
    "dots1": dict(n_shared_experts=1, first_k_dense_replace=1),
    "falcon_h1": dict(mamba_d_ssm=128, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=8),
    "gemma3n_text": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=16),
    "gpt_neo": dict(attention_types=[[["global", "local"], 2]], window_size=8),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"] * 2, num_dense_layers=1),
    "kimi_linear": dict(num_experts_per_token=2, linear_head_dim=16, linear_num_heads=4),
    "longcat_flash": dict(head_dim=8, zero_expert_num=2, expert_ffn_hidden_size=32),
    "mamba2": dict(num_heads=8, head_dim=16, n_groups=1),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=4, hc_lowrank=16, linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_key_heads=2, linear_num_value_heads=4, shared_expert_intermediate_size=32),
    # hybrid layers 1 and 3 run one shared transformer block (tied across layers; the stages hold copies)
    "zamba": dict(layers_block_type=["linear_attention", "hybrid"] * 2),
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"] * 2, n_mamba_heads=4, chunk_size=8,
                   adapter_rank=8),
    "zaya": dict(num_experts_per_tok=1),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"] * 2, mamba_n_heads=8, mamba_d_head=16,
                             mamba_d_state=16, mamba_chunk_size=8),
    # residual blocks of 2 layers (as the real model's several): block_states grows between the layers
    "inkling2_text": dict(n_layers_per_attn_res_block=2),
    # its middle layers run in a loop (layers 2-3 twice), as the real model's 6-17 three times; the defaults (loop
    # from layer 6) would loop nothing at 4 layers
    "inkling2_loop_text": dict(n_layers_per_attn_res_block=2, loop_layer_index_start=2, loop_layer_index_end=4,
                               loop_num_passes=2),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
}
_MULTIMODAL_KEYS = ("vision", "audio", "image", "speech", "vq_", "visual")
TINY_MAX_PARAMS = 20_000_000  # a tiny text model here has well under 1M; more means full-size sub-models


@dataclass
class Verdict:
    model_type: str
    verdict: str  # exact | differs | refused | skipped | error
    reason: str = ""
    seconds: float = 0.0


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str):
    from transformers import AutoConfig

    d = AutoConfig.for_model(model_type).to_dict()
    kw = {}
    for names, v in TINY:
        for n in names:
            cur = d.get(n, "absent")
            if cur is None and n == "q_lora_rank" or cur == "absent":
                continue  # (no q_lora_rank: full-rank queries)
            if cur is None or type(cur) is type(v) or isinstance(v, float) and isinstance(cur, (int, float)):
                kw[n] = v
    for k in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(d.get(k), int) and d[k] >= 512:
            kw[k] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}[k]
    if "kv_lora_rank" in d:  # multi-head latent attention: head sizes come from the rope / nope / v dims
        kw.pop("head_dim", None)
        kw["num_key_value_heads"] = 4
    kw.update(OVERRIDES.get(model_type, {}))
    return AutoConfig.for_model(model_type, **kw)


def skip_reason(model_type: str) -> str | None:
    """Why a type is not a decoder-only text causal LM, from its config and class (built on the meta device only
    when the config carries a media sub-config); None: it is one, or may be."""
    import inspect

    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    cls = getattr(transformers, name, None)
    params = inspect.signature(cls.forward).parameters if cls is not None else {}
    if cls is not None and "labels" not in params:  # e.g. Gemma-4's speculative-decoding assistants
        needs = [k for k in params if k not in ("self", "input_ids", "kwargs", "use_cache", "position_ids", "attention_mask")]
        return (f"not causal: {name}.forward takes no labels (computes no language-modeling loss; it reads "
                f"{', '.join(needs) or 'other inputs'} from a target model): not trainable on its own")
    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "is_encoder_decoder", False):
        return "encoder-decoder"
    if "ConditionalGeneration" in name:
        return f"multimodal ({name})"
    takes = [k for k in ("pixel_values", "image_patches", "input_features", "input_values") if k in params]
    if takes:
        return f"multimodal ({name}.forward takes {takes[0]})"
    mm = multimodal_subconfigs(cfg)
    if not mm:
        return None
    twins = [t for t, n in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if n == name and t != model_type]
    if twins:  # the multimodal config of a text model registered under its own type (qwen4_exp / qwen4_exp_text)
        return f"multimodal ({', '.join(mm)}): its text model {name} is checked as {twins[0]}"
    # a media sub-config the class may not use (Moshi's text LM ignores its audio codec's): built on the meta device,
    # a model that holds media modules, or full-size ones the tiny config does not reach, is multimodal
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            meta = AutoModelForCausalLM.from_config(tiny_config(model_type))
    except Exception as e:
        return f"multimodal ({', '.join(mm)}): no text model builds from this config ({type(e).__name__})"
    media = [n for n, _ in meta.named_parameters() if any(w in n for w in _MULTIMODAL_KEYS)]
    size = sum(t.numel() for t in meta.parameters())
    if media or size > TINY_MAX_PARAMS:
        return f"multimodal ({', '.join(mm)}): {name} holds " + (media[0].rsplit(".", 2)[0] if media else
                                                                f"{size / 1e6:.0f}M parameters at the tiny size")
    return None


def multimodal_subconfigs(cfg) -> list[str]:
    subs = [k for k, v in cfg.to_dict().items() if isinstance(v, dict) and k.endswith("config")]
    return [k for k in subs if any(w in k for w in _MULTIMODAL_KEYS)]


def build(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().eval()
    with torch.no_grad():  # off the init distribution (zero biases, unit norms): every weight shows in the gradients
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model


def is_causal(model, vocab: int) -> bool:
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(3))
    other = ids.clone()
    other[0, -1] = (other[0, -1] + 1) % vocab
    kw = {"use_cache": False} if _takes_cache(model) else {}
    with torch.no_grad():
        a, b = model(ids, **kw).logits[:, :-1], model(other, **kw).logits[:, :-1]
    return torch.allclose(a, b, rtol=1e-4, atol=1e-5)  # MoE kernels group tokens by expert: not bit-exact


def compare(model, num_stages, ids, ref_loss, ref_grads) -> str | None:
    """None when the chained stages give the model's loss and every gradient; else what differs."""
    model.zero_grad(set_to_none=True)
    stages = partition_model(model, num_stages, check=False)
    x = ids
    for s in stages[:-1]:
        x = s(x)
    loss = stages[-1](x, labels=ids)
    if not torch.allclose(loss, ref_loss, rtol=1e-5, atol=0):
        return f"p={num_stages}: loss {float(loss):.7g} != {float(ref_loss):.7g}"
    loss.backward()
    grads = {}
    for s in stages:
        for n, p in s.named_parameters():
            if n in grads:
                return f"p={num_stages}: {n} held by two stages"
            grads[n] = p.grad
    for first, last in tied_parameters(stages):
        a, b = grads[first], grads.pop(last)
        grads[first] = b if a is None else (a if b is None else a + b)
    if set(grads) != set(ref_grads):
        return f"p={num_stages}: stage parameters differ from the model's: {sorted(set(grads) ^ set(ref_grads))[:3]}"
    for n, g in ref_grads.items():
        got = grads[n]
        if (g is None) != (got is None):
            return f"p={num_stages}: gradient of {n} is {'missing' if got is None else 'unexpected'}"
        if g is not None and not ((got - g).abs() <= 1e-6 + 1e-5 * g.abs()).all():
            return f"p={num_stages}: gradient of {n} off by {float((got - g).abs().max()):.3g}"
    return None


def check_type(model_type: str, stage_counts=(2, 3, 4)) -> Verdict:
    t0 = time.perf_counter()
    try:
        reason = skip_reason(model_type)
    except Exception as e:  # the type's default config does not validate (e.g. gemma4_assistant)
        return Verdict(model_type, "error", f"its default config does not build: {type(e).__name__}: {str(e)[:160]}")
    if reason:
        return Verdict(model_type, "skipped", reason)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build(model_type)
        except Exception as e:
            if getattr(tiny_config(model_type), "is_decoder", None) is False:
                return Verdict(model_type, "skipped", "not causal: an encoder (is_decoder=False) with an optional causal head")
            return Verdict(model_type, "error", f"cannot build a tiny model: {type(e).__name__}: {str(e)[:160]}")
        vocab = model.config.vocab_size
        try:
            if not is_causal(model, vocab):
                return Verdict(model_type, "skipped", "not causal: logits at position t depend on later tokens (an encoder)")
        except Exception as e:
            if getattr(model.config, "is_decoder", None) is False:
                return Verdict(model_type, "skipped", "not causal: an encoder (is_decoder=False) with an optional causal head")
            return Verdict(model_type, "error", f"the tiny model does not run: {type(e).__name__}: {str(e)[:160]}")
        ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
        ref = model(input_ids=ids, labels=ids, use_cache=False) if _takes_cache(model) else model(input_ids=ids, labels=ids)
        ref.loss.backward()
        ref_grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        for p in stage_counts:
            try:
                diff = compare(model, p, ids, ref.loss.detach(), ref_grads)
            except PartitionError as e:
                return Verdict(model_type, "refused", str(e), time.perf_counter() - t0)
            except Exception as e:
                return Verdict(model_type, "differs", f"p={p}: stages fail: {type(e).__name__}: {str(e)[:200]}",
                               time.perf_counter() - t0)
            if diff:
                return Verdict(model_type, "differs", diff, time.perf_counter() - t0)
    return Verdict(model_type, "exact", "", time.perf_counter() - t0)


def _takes_cache(model) -> bool:
    import inspect

    return "use_cache" in inspect.signature(type(model).forward).parameters
