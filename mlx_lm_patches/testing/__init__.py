"""Test fixtures shipped with the package (the ``check`` command uses them too): tiny
random-weight models for every hybrid family (``tiny_models``) and complete model folders on
disk with a locally built tokenizer (``model_folder``). Nothing here downloads anything."""
