"""tests/distributed needs torch.distributed with gloo; builds without it skip the whole folder."""

import torch.distributed as dist

if not (dist.is_available() and dist.is_gloo_available()):
    collect_ignore_glob = ["test_*.py"]
