"""wanlink.plan"""
