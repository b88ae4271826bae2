"""Two real processes (jax.distributed on localhost, two CPU devices each) read packed documents:
each reads only its own share of every epoch's pieces, and their rows form the global batch."""
from tests.processes import run_two_processes

# argv = port, process id. Builds the trainer's iterator for this process's rows of a global
# batch of 8 over data 4, places two batches on the mesh and gathers them back whole.
WORKER = """
import json, sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=f"localhost:{sys.argv[1]}", num_processes=2,
                           process_id=int(sys.argv[2]))
import numpy as np
from jax.experimental import multihost_utils
from k3jax.data import DocumentIterator, Packing
from k3jax.sharding import rules as rules_lib
from k3jax.train import sharded_state
from k3jax.parallel.config import ParallelConfig
docs = [1000 * (d + 1) + np.arange(5 + 7 * (d % 9), dtype=np.int32) for d in range(80)]
mesh = ParallelConfig.from_trainer_config({}).make_mesh(jax.devices())
block, blocks = sharded_state.process_rows(mesh, 8, rules_lib.DEFAULT_RULES)
it = DocumentIterator(docs, Packing(seq_len=16, max_documents_per_row=3, bins=4, prefetch=0),
                      global_batch_size=8, seed=0, process_index=block, process_count=blocks)
out = {"block": [block, blocks], "local": [], "global": []}
for _ in range(2):
  local = next(it)
  placed = sharded_state.shard_batch(local, mesh)
  whole = multihost_utils.process_allgather(placed["inputs"], tiled=True)
  out["local"].append(local["inputs"].tolist())
  out["global"].append(np.asarray(whole).tolist())
print("RESULT " + json.dumps(out))
"""


def test_each_process_reads_its_own_documents_and_the_rows_form_the_global_batch():
  results = run_two_processes(WORKER, timeout=300)
  assert [r["block"] for r in results] == [[0, 2], [1, 2]]
  # Disjoint pieces: every token id is unique and an input at most once per epoch.
  tokens_of = lambda r: {x for batch in r["local"] for row in batch for x in row if x}
  assert tokens_of(results[0]) and tokens_of(results[1])
  assert not tokens_of(results[0]) & tokens_of(results[1])
  for step in range(2):
    # Both processes see the same global batch: process 0's 4 rows, then process 1's.
    assert results[0]["global"][step] == results[1]["global"][step]
    assert results[0]["global"][step] == results[0]["local"][step] + results[1]["local"][step]
