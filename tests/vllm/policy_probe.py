"""vLLM's EPLB policy entry point, called the way vLLM 0.33 calls it, in vLLM's own environment.

Reads ``{weight, num_replicas, num_groups, num_nodes, num_ranks, old}`` as JSON on stdin, loads
vLLM's general plugins as every vLLM process does (``vllm.plugins.load_general_plugins``), takes
the policy class vLLM's ``EplbState`` would take (``EPLB_POLICIES["default"]``) and calls its
``rebalance_experts`` with CPU int64 tensors; prints ``{policy, phy2log}`` as JSON. Whether
Baton's plugin is loaded depends only on the ``PYTHONPATH`` the test gives (its install
directory, or none).
"""

from __future__ import annotations

import json
import logging
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
logging.disable(logging.WARNING)

import torch  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402


def main() -> None:
    query = json.load(sys.stdin)
    load_general_plugins()
    from vllm.distributed.eplb.policy import EPLB_POLICIES

    policy = EPLB_POLICIES["default"]
    phy2log = policy.rebalance_experts(
        torch.tensor(query["weight"], dtype=torch.int64),
        query["num_replicas"],
        query["num_groups"],
        query["num_nodes"],
        query["num_ranks"],
        torch.tensor(query["old"], dtype=torch.int64),
    )
    assert phy2log.device == torch.device("cpu")  # what vLLM's async worker asserts
    json.dump({"policy": policy.__name__, "phy2log": phy2log.tolist()}, sys.stdout)


if __name__ == "__main__":
    main()
