"""wanlink.collectives"""
