"""Hugging Face interop, above the model, the checkpoints and the data it joins: config.json <-> model config per
family (families.py, moe_families.py, config_json.py), HF folders checked whole (folder.py), export and import of
checkpoints (convert.py, launch/convert.py) and ``model.init_from`` (init.py: each rank reads its tp block)."""
