"""Networking (the only package that imports hivemind): DHT nodes, swarm records, averaging groups."""
