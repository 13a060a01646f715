"""wanlink.io"""
