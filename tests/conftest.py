import torch

# Forked ranks must not inherit a busy intra-op thread pool; tiny tensors need no threads anyway.
torch.set_num_threads(1)
