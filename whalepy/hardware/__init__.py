"""The hardware: node groups and links (``nodes.py``), their dict / YAML schema (``schema.py``) and the
cluster spec built from them (``ClusterSpec``, rank placement; ``cluster.py``). Imports the data model and
the cost models."""
