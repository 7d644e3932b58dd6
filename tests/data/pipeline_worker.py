"""Resumes TextPipelines in a fresh process: `pipeline_worker.py JOBS.json`.

JOBS.json is a list of {"pipeline": TextPipeline kwargs, "state": saved state, "batches": n, "out": dir};
each job restores the state and writes its next n batches as dir/{i}_{key}.npy.
"""

import json
import os
import sys

import numpy as np

from jaxtrain.data.pipeline import TextPipeline

if __name__ == "__main__":  # grain may spawn workers: guard the entry point
  with open(sys.argv[1]) as f:
    jobs = json.load(f)
  for job in jobs:
    pipeline = TextPipeline(**job["pipeline"])
    pipeline.set_state(job["state"])
    os.makedirs(job["out"], exist_ok=True)
    for i in range(job["batches"]):
      for key, value in next(pipeline).items():
        np.save(os.path.join(job["out"], f"{i}_{key}.npy"), value)
