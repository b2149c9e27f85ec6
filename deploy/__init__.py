"""Launchers and deployment assets: the ``sie`` command, container images, compose, Helm docs."""
