"""Perplexity from summed next-token negative log-likelihoods, as an ``evaluate`` metric.

Shipped with hf_asyncpp because Hub metric scripts cannot be fetched offline. Feed it per-block
(or per-batch) NLL sums and token counts, from a plain model or from the last pipeline stage:

    metric = evaluate.load("/abs/path/to/hf_asyncpp/eval/metrics/perplexity")
    metric.add_batch(nll_sum=[41.2, 39.8], num_tokens=[127, 127])   # as many batches as needed
    metric.compute()  # {"eval_loss": ..., "perplexity": ..., "num_tokens": 254}
"""
import math

import datasets
import evaluate

_DESCRIPTION = "Perplexity = exp(total NLL / total predicted tokens); also reports eval_loss (mean NLL per token)."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="nll_sum: summed NLL of a block or batch; num_tokens: predicted tokens in it",
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "num_tokens": datasets.Value("int64")}),
        )

    def _compute(self, nll_sum, num_tokens):
        total, n = float(sum(nll_sum)), int(sum(num_tokens))
        if n <= 0:
            raise ValueError(f"perplexity of {n} tokens: give the number of predicted tokens of each block")
        loss = total / n
        return {"eval_loss": loss, "perplexity": math.exp(loss) if loss < 709.0 else math.inf, "num_tokens": n}
