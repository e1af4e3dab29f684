"""Packaged rule files (installed as ``ktinject.rulefiles``); see ktinject/injection/rules.py."""
