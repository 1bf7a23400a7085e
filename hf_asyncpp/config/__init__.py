"""The recipe: one YAML file -> typed, strictly validated dataclasses (docs/recipes.md lists every field).

=============  ==========================================================================================
``recipe``     ``Recipe`` and its pipeline/training/hub/eval sections; ``load_recipe``, overrides, cross-field checks
``sources``    the model and data sections (what a run trains, what it reads); ``bounds`` for ranged fields
``optimizer``  the optimizer section: optimizer, hyperparameters, the delay correction
``names``      field names users bring from elsewhere (``TrainingArguments``' names, renamed fields)
=============  ==========================================================================================

One package keeps the one loader, the checks that span sections and the generated reference in view.
"""
