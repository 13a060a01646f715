"""wanlink.probe"""
