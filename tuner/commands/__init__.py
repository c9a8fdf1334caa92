"""The commands of ``python -m tuner``, grouped by job: ``study`` tunes (run, dispatch),
``read`` reads a study back (trials, best, export, compare, report), ``device`` compiles
or times kernels without a study (probe, bench). ``args`` turns parsed flags into what a
command works on. Each module loads heavy libraries (torch, TileLang, Optuna, pandas)
only inside the command that needs them, so that ``tuner.cli`` parses at once."""
