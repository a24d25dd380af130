"""The main job and the experiment runner: what ``attnres compare`` and ``attnres experiment NAME``
run. ``presets`` names every experiment (the main job ``compare`` and the report's grids) and
its variants; ``runner`` trains each (variant, seed) into its run directory, resumably
(``override_paths``: the grid's path overrides made absolute);
``overhead`` times one step of every variant side by side; ``compare`` writes the main job's
report (losses at equal steps, compute and time, magnitudes, depth weights), ``analyze`` the
depth-mixing analysis of trained runs (``attnres analyze``), and ``report`` writes any
experiment's report.md, drawing the scaling and multiplier sections from
:mod:`attnres.experiments.grids`. May import the package's layers below it and the shared
helpers of :mod:`attnres.experiments` (``stats``, ``flops``, ``layout``).
"""
