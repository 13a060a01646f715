"""wanlink.proto: the sans-I/O wire protocol (frames, handshake, control messages, reassembly, limits)."""
