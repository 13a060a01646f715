"""Chunk scheduling (sans-I/O): cutting messages into chunks and an EDF queue of chunks."""
