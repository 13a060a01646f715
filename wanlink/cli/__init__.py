"""wanlink.cli"""
