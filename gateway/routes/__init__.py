"""The gateway's HTTP handlers, one module per concern; :mod:`gateway.app` wires them to paths."""
