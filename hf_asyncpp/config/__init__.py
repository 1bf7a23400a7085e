"""The recipe: one YAML file -> typed, strictly validated dataclasses (docs/recipes.md lists every field).

=============  ==========================================================================================
``recipe``     ``Recipe``, ``load_recipe``, typed conversion, overrides, cross-field checks, ``save_recipe``
``sections``   the model, data, pipeline, training, hub and eval sections; ``bounds`` for ranged fields
``optimizer``  the optimizer section: optimizer, hyperparameters, the delay correction
``names``      field names users bring from elsewhere (the Trainer's, run_clm's, trl's) and the field meant here
``reference``  every field with its type, default and meaning: ``train --help`` and docs/recipes.md
=============  ==========================================================================================

One package keeps the one loader, the checks that span sections and the generated reference in view.
"""
