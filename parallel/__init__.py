"""How ranks are arranged and talk: topology, collectives, tensor and pipeline parallelism."""
