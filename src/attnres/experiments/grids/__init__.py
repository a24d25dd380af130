"""The analyses of the report's experiment grids, beyond a table of losses: the scaling-law
grid (``scaling_grid`` reads the runs, ``scaling_fit`` fits the power laws and the compute
multiplier, ``scaling_report`` writes the section) and the compute-multiplier grid
(``multiplier`` reads a loss off a ladder of standard models, ``multiplier_report`` writes
the section). The ablation and block-size grids need nothing beyond the common report of
:mod:`attnres.experiments.job`. Pure functions of finished runs' records: they train
nothing and import only numpy, scipy and the shared ``attnres.experiments.stats``.
"""
