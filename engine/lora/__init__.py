"""Multi-LoRA: PEFT adapters served on one base model, mixed in one batch.

``adapter`` reads and checks an adapter; ``slots`` keeps every loaded adapter in host memory and up
to ``max_loras`` of them in device slots (swapped in LRU, pinned while a sequence uses them);
``batch`` carries one step's token-to-slot map and the update each projection adds (torch), and
``kernels`` the same update in Triton for CUDA.
"""
