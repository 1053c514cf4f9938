"""``paralab plan``'s cost model: a cluster, a workload, the layouts, a prediction for each, a ranking.

One concept per module: ``cluster.py`` (a cluster and its presets, a user's file), ``calibrate.py``
(this machine, measured), ``collectives.py`` (its collectives timed as a run meets them), ``workload.py`` (the model as units), ``layouts.py`` (what is enumerated),
``predict.py`` (one layout's step and memory), ``search.py`` (the plan), ``published.py`` (published
training runs, each laid out as it was, beside the planner's prediction). docs/plan.md explains the
assumptions.
"""
from .cluster import PRESETS, Cluster, load_cluster
from .layouts import Layout, enumerate_layouts
from .predict import Prediction, Setting, predict
from .search import Evaluation, NoLayout, Plan, evaluate, make_plan, why_first
from .workload import Workload, cnn_workload, gpt_workload

__all__ = ["PRESETS", "Cluster", "Evaluation", "evaluate", "Layout", "NoLayout", "Plan", "Prediction", "Setting", "Workload", "cnn_workload",
           "enumerate_layouts", "gpt_workload", "load_cluster", "make_plan", "predict", "why_first"]
