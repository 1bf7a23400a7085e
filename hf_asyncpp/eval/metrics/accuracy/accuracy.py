"""Accuracy as an ``evaluate`` metric (shipped: Hub metric scripts cannot be fetched offline)."""
import datasets
import evaluate

_DESCRIPTION = "Accuracy = share of predictions equal to their reference."


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description="predictions and references: integer class ids",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}),
        )

    def _compute(self, predictions, references):
        if not references:
            raise ValueError("accuracy of zero items")
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / len(references)}
