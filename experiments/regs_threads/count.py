"""How the committed studies' trials of register scores ended, by threads and chunk:
``python experiments/regs_threads/count.py > experiments/regs_threads/count.txt``
(every ``trials.csv`` under ``experiments/``)."""

import glob

import pandas as pd

frames = []
for path in sorted(glob.glob("experiments/**/trials.csv", recursive=True)):
    frame = pd.read_csv(path)
    if {"scores", "threads", "chunk", "status"} <= set(frame.columns):
        frames.append(frame.assign(file=path)[["file", "scores", "threads", "chunk", "status"]])
regs = pd.concat(frames).query("scores == 'regs'")
print(regs.groupby(["threads", "chunk", "status"]).size().to_string())
print()
print("files with register scores at 256 threads, by status:")
print(regs.query("threads == 256").groupby(["file", "status"]).size().to_string())
