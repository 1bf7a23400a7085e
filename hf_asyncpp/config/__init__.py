"""The recipe: one YAML file -> typed, strictly validated dataclasses (docs/recipes.md lists every field).

=============  ==========================================================================================
``recipe``     ``Recipe`` and its pipeline/training/hub/eval sections; ``load_recipe``, overrides, cross-field checks
``sources``    the model and data sections (what a run trains, what it reads); ``bounds`` for ranged fields
``optimizer``  the optimizer section: optimizer, hyperparameters, the delay correction
``names``      field names users bring from elsewhere (the Trainer's, run_clm's, trl's) and the field meant here
``reference``  every field with its type, default and meaning: ``train --help`` and docs/recipes.md
=============  ==========================================================================================

One package keeps the one loader, the checks that span sections and the generated reference in view.
"""
