"""wanlink.kernels"""
