"""wanlink.compress"""
