"""wanlink.sched"""
