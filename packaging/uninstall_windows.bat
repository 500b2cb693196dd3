@echo off
rem Double-click to uninstall specchat: removes installer_files\ (environment, Python, caches) and
rem the shortcuts; this folder's own files and your conversations stay.
rem The steps are in windows\launcher.ps1 (PowerShell, which every Windows 10 and 11 has).
setlocal
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0windows\launcher.ps1" uninstall %*
exit /b %errorlevel%
