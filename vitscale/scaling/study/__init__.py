"""The scaling study, all of it: grids of (model x epochs x data size) pre-trained and transferred,
to compute-vs-accuracy tables, frontiers and fits (the paper's Sec. 4.3-4.4, Table 6, Figures 3-5).

The Ray-free parts (the layer of `eval/`: nothing in them imports Ray or a stage):

- `config.py`: the `study:` section (cells, transfer protocols, budget, device and price);
- `cells.py`: a cell and its stable id;
- `plan.py`, `costs.py`: each cell's compute, device-hours, wall time and cost before anything runs;
- `state.py`: one JSON file per cell in the study directory (local or s3://): skip, resume, retry;
- `fit.py`, `uncertainty.py`: the frontier, the saturating power law, bootstrap intervals,
  identifiability warnings and the backtest (pure);
- `report.py`, `plots.py`, `recommend.py`: the tables, the Figure-5 and Sec.-4.3 plots, `recommend`.

The stage (the layer of `stages/`, registered as `study` in `vitscale/stages/__init__.py`):

- `stage.py`: the study stage's shape: checks when a pipeline loads, checks against the data, the run;
- `cell_pipelines.py`: the study section resolved into cells, each a pipeline of the existing stages;
- `runner.py`: cells on Ray, as many at once as the cluster fits (the one module here that imports Ray).

`vitscale study plan / report / recommend` are in `vitscale/cli/study.py`.
"""
