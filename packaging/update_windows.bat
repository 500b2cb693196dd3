@echo off
rem Double-click to update specchat: pulls the new version (in a git checkout) and installs what it
rem needs into this folder.
rem The steps are in windows\launcher.ps1 (PowerShell, which every Windows 10 and 11 has).
setlocal
powershell.exe -NoProfile -ExecutionPolicy Bypass -File "%~dp0windows\launcher.ps1" update %*
exit /b %errorlevel%
