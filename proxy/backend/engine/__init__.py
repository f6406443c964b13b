"""Engine mode's target: the model in this process (Transformers), verifying a whole
tree in one forward pass (`local.LocalTarget`, `decoder`, `token_choice`), and the model code it shares
with the in-process drafters (`hf`: loading, caches, target features; `linear`: packed
matmuls)."""
