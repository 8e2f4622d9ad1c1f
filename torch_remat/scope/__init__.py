"""``remat.gradient_checkpoint_scope``: "what not to store" checkpointing.

Records the ops run inside the scope and stores recipes instead of their saved
tensors; built on the shared autograd-hook primitives, independent of the
checkpoint engine except for asking it whether a checkpoint is active.
"""
