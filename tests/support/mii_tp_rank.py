"""One rank of a tensor-parallel ``mii.pipeline`` with hcache, run by tests/mii/test_mii.py as its own process:
``python mii_tp_rank.py MODEL_DIR STORE OUT.json ZMQ_PORT`` with the launcher's RANK/WORLD_SIZE/... set."""

import json
import os
import sys

import hcache.mii
from test_mii import NEW_TOKENS, QUESTIONS, converse

model_dir, store, out, zmq_port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
pipe = hcache.mii.pipeline(
    model_dir,
    tensor_parallel=int(os.environ["WORLD_SIZE"]),
    all_rank_output=True,  # every rank builds the next turn's prompt from the replies
    zmq_port_number=zmq_port,
    hcache={
        "engine": "reference",
        "store_dirs": [store],
        "request_log": f"{store}/requests.jsonl",
        "plan": "H",
        "readers": 0,
    },
)
replies = converse(
    model_dir, lambda prompt, _: pipe([prompt], max_new_tokens=NEW_TOKENS, do_sample=False)[0].generated_text
)
for _ in range(2):  # in a namespace of its own: the second restores what the first stored
    pipe([2 * QUESTIONS[0]], max_new_tokens=1, cache_salt="tenant-b")
pipe.inference_engine.close()
with open(out, "w") as f:
    json.dump(replies, f)
