"""wanlink.optim"""
