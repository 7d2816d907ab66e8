"""The hardware: the cluster spec (``ClusterSpec``, node groups, links; ``cluster.py``) and its dict / YAML
schema (``schema.py``). Imports the data model and the cost models."""
